// Package docs holds the rules the Markdown documentation is checked by:
// how a code host turns a heading into an anchor, and which links of a
// page point at a file or heading that does not exist.
package docs

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"unicode"
)

// Anchor returns the fragment a code host gives a heading: its text
// lowercased, every character that is not a letter, a digit, a space, a
// hyphen or an underscore dropped, and each space made a hyphen. Code
// spans, emphasis and links count by their text.
func Anchor(heading string) string {
	heading = markdownLink.ReplaceAllString(heading, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// markdownLink is an inline link or image: [text](target).
var markdownLink = regexp.MustCompile(`!?\[([^\]]*)\]\(([^)\s]*)(?:\s+"[^"]*")?\)`)

// Anchors returns the anchors of the headings of a Markdown text, with the
// suffixes a code host gives repeated ones (-1, -2, ...). Lines inside
// fenced code blocks are not headings.
func Anchors(text string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	fenced := false
	for line := range strings.Lines(text) {
		line = strings.TrimRight(line, "\r\n")
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if fenced {
			continue
		}
		m := heading.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		a := Anchor(m[1])
		if n := seen[a]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			anchors[a] = true
		}
		seen[a]++
	}
	return anchors
}

var heading = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)

// Link is one link of a page: its target as written and its line.
type Link struct {
	Target string
	Line   int
}

// Links returns the inline links and images of a Markdown text, outside
// code blocks and code spans.
func Links(text string) []Link {
	var links []Link
	fenced := false
	n := 0
	for line := range strings.Lines(text) {
		n++
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if fenced {
			continue
		}
		line = codeSpan.ReplaceAllString(line, "")
		for _, m := range markdownLink.FindAllStringSubmatch(line, -1) {
			links = append(links, Link{Target: m[2], Line: n})
		}
	}
	return links
}

var codeSpan = regexp.MustCompile("`[^`]*`")

// Broken returns, for the Markdown file at path, each relative link whose
// file does not exist and each #anchor (on the page itself or on another
// Markdown file) that no heading there has. Links with a scheme (https:,
// mailto:) are not followed.
func Broken(path string) ([]string, error) {
	text, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var broken []string
	pages := map[string]map[string]bool{}
	anchorsOf := func(file string) (map[string]bool, error) {
		if a, ok := pages[file]; ok {
			return a, nil
		}
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, err
		}
		pages[file] = Anchors(string(b))
		return pages[file], nil
	}
	for _, l := range Links(string(text)) {
		if scheme.MatchString(l.Target) {
			continue
		}
		file, frag, _ := strings.Cut(l.Target, "#")
		target := path
		if file != "" {
			target = filepath.Join(filepath.Dir(path), filepath.FromSlash(file))
			if _, err := os.Stat(target); err != nil {
				broken = append(broken, fmt.Sprintf("%s:%d: %s: no such file", path, l.Line, l.Target))
				continue
			}
		}
		if frag == "" {
			continue
		}
		if filepath.Ext(target) != ".md" {
			broken = append(broken, fmt.Sprintf("%s:%d: %s: an anchor into a file that is not Markdown", path, l.Line, l.Target))
			continue
		}
		anchors, err := anchorsOf(target)
		if err != nil {
			return nil, err
		}
		if !anchors[frag] {
			broken = append(broken, fmt.Sprintf("%s:%d: %s: no heading has the anchor #%s", path, l.Line, l.Target, frag))
		}
	}
	return broken, nil
}

var scheme = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)

// Ragged returns the rows of the Markdown text's tables whose cell count
// is not their header's: a code host shows a row's extra cells nowhere,
// and a short row leaves its last columns empty. A table is a header
// line, then a delimiter line of dashes, then its rows; pipes inside code
// spans or escaped with a backslash do not part cells. Lines inside fenced
// code blocks are not tables.
func Ragged(text string) []string {
	var out []string
	lines := strings.Split(text, "\n")
	fenced := false
	header := -1
	for i, l := range lines {
		t := strings.TrimSpace(l)
		if strings.HasPrefix(t, "```") {
			fenced = !fenced
			header = -1
			continue
		}
		if fenced || !strings.HasPrefix(t, "|") {
			header = -1
			continue
		}
		if header >= 0 {
			if n := cells(t); n != header {
				out = append(out, fmt.Sprintf("line %d: %d cells, its header %d", i+1, n, header))
			}
			continue
		}
		if i+1 < len(lines) && tableDelimiter.MatchString(strings.TrimSpace(lines[i+1])) {
			header = cells(t)
		}
	}
	return out
}

var tableDelimiter = regexp.MustCompile(`^\|(\s*:?-+:?\s*\|)+$`)

// cells counts the cells of a table row.
func cells(row string) int {
	row = codeSpan.ReplaceAllString(row, "x")
	row = strings.ReplaceAll(row, `\|`, "x")
	row = strings.TrimSuffix(strings.TrimPrefix(row, "|"), "|")
	return strings.Count(row, "|") + 1
}
