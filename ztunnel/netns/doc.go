// Package netns runs code and creates sockets inside Linux network
// namespaces given as open files (an nsfs file: /var/run/netns/<name>,
// /proc/<pid>/ns/net, or a descriptor received over SCM_RIGHTS).
//
// A network namespace is a property of an OS thread, and a socket belongs to
// the namespace of the thread that created it for its whole life. So Do
// enters the namespace on a locked OS thread of its own, runs a function and
// leaves; Listen, ListenPacket and Dialer create their sockets that way and
// hand them back as ordinary net.Listener / net.Conn values served by the
// usual goroutines and netpoller: only the socket() (and, for listeners,
// bind and listen) system calls run in the namespace, never a blocking wait.
//
// Entering a namespace needs CAP_SYS_ADMIN; setting SO_MARK needs
// CAP_NET_ADMIN.
package netns
