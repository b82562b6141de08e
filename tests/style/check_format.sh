#!/usr/bin/env bash
# The house style as a test: every tracked C++ source is as `clang-format` prints it with the
# repository's .clang-format (Google style, 100 columns). Usage: check_format.sh <clang-format> <source dir>.
# Prints the files that drift and the first lines of each difference; exit 1 when any does.
set -euo pipefail
clang_format="$1"
cd "$2"
mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' 2>/dev/null || find common learner rollout services tests -name '*.h' -o -name '*.cc')
if [ "${#files[@]}" -eq 0 ]; then
  echo "check_format: no sources found under $2" >&2
  exit 1
fi
# The checker must be able to fail: a badly formatted line has to come back changed.
bad='int  f( int a ){return a;}'
if [ "$(printf '%s\n' "$bad" | "$clang_format" --style=file --assume-filename=x.cc)" = "$bad" ]; then
  echo "check_format: $clang_format left a misformatted line as it was; is .clang-format read?" >&2
  exit 1
fi
diff_file=$(mktemp)
trap 'rm -f "$diff_file"' EXIT
drift=0
for f in "${files[@]}"; do
  if ! diff -u "$f" <("$clang_format" --style=file "$f") > "$diff_file"; then
    drift=$((drift + 1))
    echo "check_format: $f is not formatted (clang-format -i $f):"
    head -n 20 "$diff_file"
  fi
done
echo "check_format: ${#files[@]} files, $drift not formatted"
[ "$drift" -eq 0 ]
