#!/usr/bin/env bash
# Every citation of the design (docs/design.md#<heading> in code comments, design.md#<heading> in the docs)
# names a heading docs/design.md has, and no file cites the design by a section number.
# usage: design_refs_test.sh <source dir>
set -u
root=$1
design=$root/docs/design.md
[ -f "$design" ] || { echo "FAIL: $design is missing"; exit 1; }
# GitHub's anchors: lower case, punctuation dropped, spaces to hyphens.
anchors=$(grep -E '^#{1,4} ' "$design" | sed -E 's/^#+ //' | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9 -]//g; s/ /-/g')
sources=()
for part in README.md CMakeLists.txt docs runtime parallel moe optim checkpoint launch examples bench tests; do
  [ -e "$root/$part" ] && sources+=("$root/$part")
done
failed=0 cited=0
while IFS=: read -r file line anchor; do
  cited=$((cited + 1))
  if ! grep -qxF "$anchor" <<<"$anchors"; then
    echo "FAIL: ${file#$root/}:$line cites design.md#$anchor, which is no heading of docs/design.md"
    failed=1
  fi
done < <(grep -rnoE --include='*.h' --include='*.cc' --include='*.cu' --include='*.md' --include='*.sh' \
           --include='*.py' --include='*.txt' 'design\.md#[a-z0-9-]+' "${sources[@]}" | sed -E 's/design\.md#//')
if grep -rnE --include='*.h' --include='*.cc' --include='*.cu' --include='*.md' 'design section [0-9]' "${sources[@]}"; then
  echo "FAIL: the lines above cite the design by a section number; cite docs/design.md#<heading>"
  failed=1
fi
[ "$cited" -gt 10 ] || { echo "FAIL: only $cited citations found: is the source dir right?"; failed=1; }
[ $failed -eq 0 ] && echo "design_refs_test: $cited citations, every one a heading of docs/design.md"
exit $failed
