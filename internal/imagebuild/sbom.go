package imagebuild

import (
	"crypto/sha256"
	"debug/buildinfo"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"time"
)

// SBOMMediaType is the media type of the SBOM layer and the artifactType of
// its manifest.
const SBOMMediaType = "application/spdx+json"

// SPDX is the part of an SPDX 2.3 JSON document that imagebuild writes.
type SPDX struct {
	SPDXVersion       string             `json:"spdxVersion"`
	DataLicense       string             `json:"dataLicense"`
	SPDXID            string             `json:"SPDXID"`
	Name              string             `json:"name"`
	DocumentNamespace string             `json:"documentNamespace"`
	CreationInfo      SPDXCreationInfo   `json:"creationInfo"`
	Packages          []SPDXPackage      `json:"packages"`
	Relationships     []SPDXRelationship `json:"relationships"`
}

// SPDXCreationInfo says when and by what a document was made.
type SPDXCreationInfo struct {
	Created  string   `json:"created"`
	Creators []string `json:"creators"`
}

// SPDXPackage is one Go module (or the toolchain's standard library).
type SPDXPackage struct {
	SPDXID           string            `json:"SPDXID"`
	Name             string            `json:"name"`
	VersionInfo      string            `json:"versionInfo,omitempty"`
	DownloadLocation string            `json:"downloadLocation"`
	FilesAnalyzed    bool              `json:"filesAnalyzed"`
	LicenseConcluded string            `json:"licenseConcluded"`
	LicenseDeclared  string            `json:"licenseDeclared"`
	CopyrightText    string            `json:"copyrightText"`
	Checksums        []SPDXChecksum    `json:"checksums,omitempty"`
	ExternalRefs     []SPDXExternalRef `json:"externalRefs,omitempty"`
	Comment          string            `json:"comment,omitempty"`
}

// SPDXChecksum is a digest of a package's content.
type SPDXChecksum struct {
	Algorithm string `json:"algorithm"`
	Value     string `json:"checksumValue"`
}

// SPDXExternalRef points at a package elsewhere (here: its purl).
type SPDXExternalRef struct {
	Category string `json:"referenceCategory"`
	Type     string `json:"referenceType"`
	Locator  string `json:"referenceLocator"`
}

// SPDXRelationship links two elements of the document.
type SPDXRelationship struct {
	Element string `json:"spdxElementId"`
	Type    string `json:"relationshipType"`
	Related string `json:"relatedSpdxElement"`
}

var spdxIDUnsafe = regexp.MustCompile(`[^A-Za-z0-9.-]+`)

func spdxID(kind, name string) string {
	return "SPDXRef-" + kind + "-" + spdxIDUnsafe.ReplaceAllString(name, "-")
}

func purl(path, version string) string {
	return "pkg:golang/" + strings.ToLower(path) + "@" + url.PathEscape(version)
}

// SBOM describes the Go binary at path from the build information the go
// command embedded in it (debug/buildinfo): the main module as built
// (stamped with version), every dependency module with its version and
// go.sum hash, and the standard library of the toolchain. created is the
// document's time; the namespace is derived from the binary's digest, so
// the same binary gives the same document.
func SBOM(path, name, version string, bin []byte, created time.Time) ([]byte, error) {
	bi, err := buildinfo.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("sbom: %w", err)
	}
	sum := sha256.Sum256(bin)
	digest := hex.EncodeToString(sum[:])
	main := SPDXPackage{
		SPDXID: spdxID("Package", bi.Main.Path), Name: bi.Main.Path, VersionInfo: version,
		DownloadLocation: "NOASSERTION", LicenseConcluded: "NOASSERTION", LicenseDeclared: "Apache-2.0", CopyrightText: "NOASSERTION",
		Checksums:    []SPDXChecksum{{Algorithm: "SHA256", Value: digest}},
		ExternalRefs: []SPDXExternalRef{{Category: "PACKAGE-MANAGER", Type: "purl", Locator: purl(bi.Main.Path, version)}},
		Comment:      fmt.Sprintf("binary %s (package %s), SHA256 of the executable; build settings: %s", name, bi.Path, settings(bi)),
	}
	std := SPDXPackage{
		SPDXID: spdxID("Package", "stdlib"), Name: "stdlib", VersionInfo: bi.GoVersion,
		DownloadLocation: "NOASSERTION", LicenseConcluded: "NOASSERTION", LicenseDeclared: "BSD-3-Clause", CopyrightText: "NOASSERTION",
		ExternalRefs: []SPDXExternalRef{{Category: "PACKAGE-MANAGER", Type: "purl", Locator: purl("stdlib", bi.GoVersion)}},
	}
	doc := SPDX{
		SPDXVersion: "SPDX-2.3", DataLicense: "CC0-1.0", SPDXID: "SPDXRef-DOCUMENT", Name: name,
		DocumentNamespace: "https://github.com/isthmus-mesh/isthmus/spdx/" + name + "-" + digest,
		CreationInfo:      SPDXCreationInfo{Created: created.UTC().Format(time.RFC3339), Creators: []string{"Tool: isthmus-imagebuild", "Organization: Isthmus"}},
		Packages:          []SPDXPackage{main, std},
		Relationships: []SPDXRelationship{{Element: "SPDXRef-DOCUMENT", Type: "DESCRIBES", Related: main.SPDXID},
			{Element: main.SPDXID, Type: "DEPENDS_ON", Related: std.SPDXID}},
	}
	for _, d := range bi.Deps {
		if d.Replace != nil {
			d = d.Replace
		}
		p := SPDXPackage{
			SPDXID: spdxID("Package", d.Path+"-"+d.Version), Name: d.Path, VersionInfo: d.Version,
			DownloadLocation: "NOASSERTION", LicenseConcluded: "NOASSERTION", LicenseDeclared: "NOASSERTION", CopyrightText: "NOASSERTION",
			ExternalRefs: []SPDXExternalRef{{Category: "PACKAGE-MANAGER", Type: "purl", Locator: purl(d.Path, d.Version)}},
		}
		if d.Sum != "" {
			p.Comment = "go.sum hash " + d.Sum
		}
		doc.Packages = append(doc.Packages, p)
		doc.Relationships = append(doc.Relationships, SPDXRelationship{Element: main.SPDXID, Type: "DEPENDS_ON", Related: p.SPDXID})
	}
	return json.MarshalIndent(doc, "", "  ")
}

// settings renders the build settings (-ldflags, CGO_ENABLED, GOARCH, ...).
func settings(bi *buildinfo.BuildInfo) string {
	var parts []string
	for _, s := range bi.Settings {
		parts = append(parts, s.Key+"="+s.Value)
	}
	return strings.Join(parts, " ")
}
