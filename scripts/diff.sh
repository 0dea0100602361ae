#!/usr/bin/env bash
# Show what a chapter changed since the one before it: the diff is the lesson.
#
#   bash scripts/diff.sh 05          # 04 -> 05
#   bash scripts/diff.sh 04 07       # any two chapters
# Chapters with native code next to them (NN_name.c) are compared too, and the
# common/ module a chapter introduced (e.g. common/multinet.py for 09) is shown.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 CHAPTER [OTHER]" >&2; exit 2; }
to=$((10#$1)); from=$((10#${2:-$((to - 1))}))
[ $# -lt 2 ] || { from=$((10#$1)); to=$((10#$2)); }
pick() { ls chapters/$(printf %02d "$1")_*."$2" 2>/dev/null | head -n 1 || true; }
a=$(pick "$from" py); b=$(pick "$to" py)
[ -n "$a" ] && [ -n "$b" ] || { echo "diff: no chapter $(printf %02d "$from") or $(printf %02d "$to")" >&2; exit 2; }
git --no-pager diff --no-index --color=auto -- "$a" "$b" || true
ca=$(pick "$from" c); cb=$(pick "$to" c)
[ -z "$ca$cb" ] || git --no-pager diff --no-index --color=auto -- "${ca:-/dev/null}" "${cb:-/dev/null}" || true
# Code a chapter moved into common/ (its first line names the chapter) is part of its lesson;
# a C header, whose first lines are its cdef, names it in its first comment.
n=$(printf %02d "$to")
for f in $(grep -il "^\"\"\".*chapter $n" common/*.py || true) \
         $(grep -l "^/\* .*chapters\? $n" common/*.h || true); do
    git --no-pager diff --no-index --color=auto -- /dev/null "$f" || true
done
