#!/usr/bin/env bash
# The design's layer list and the source folders agree one to one: every folder of the libraries is
# named (`folder/`) in docs/design.md#layers, every folder named there exists, and no folder of runtime/
# holds more than 25 files.
# usage: layers_test.sh <source dir>
set -u
root=$1
design=$root/docs/design.md
[ -f "$design" ] || { echo "FAIL: $design is missing"; exit 1; }
libraries="runtime data parallel moe optim checkpoint models launch"
section=$(awk '/^## Layers$/ {on = 1; next} /^## / {on = 0} on' "$design")
[ -n "$section" ] || { echo "FAIL: docs/design.md has no '## Layers' section"; exit 1; }
named=$(grep -oE '`[a-z_]+(/[a-z_]+)*/`' <<<"$section" | tr -d '`' | sed 's#/$##' | grep -E "^(${libraries// /|})(/|\$)" | sort -u)
folders=$(cd "$root" && find $libraries -type d | sort -u)
failed=0
for folder in $folders; do
  grep -qxF "$folder" <<<"$named" || { echo "FAIL: $folder/ is a folder, but docs/design.md#layers does not name it"; failed=1; }
done
for folder in $named; do
  grep -qxF "$folder" <<<"$folders" || { echo "FAIL: docs/design.md#layers names $folder/, which is no folder"; failed=1; }
done
for folder in $(grep -E '^runtime(/|$)' <<<"$folders"); do
  files=$(find "$root/$folder" -maxdepth 1 -type f | wc -l)
  [ "$files" -le 25 ] || { echo "FAIL: $folder/ holds $files files (at most 25): split it by concept"; failed=1; }
done
[ $failed -eq 0 ] && echo "layers_test: $(wc -w <<<"$folders") folders, each named in docs/design.md#layers"
exit $failed
