#!/usr/bin/env bash
# Show what a chapter changed since the chapter it builds on: the diff is the lesson.
#
#   bash scripts/diff.sh 05          # 05 against 04, docstrings and markdown cells left out
#   bash scripts/diff.sh --all 05    # the prose kept
#   bash scripts/diff.sh 04 07       # any two chapters
#
# A chapter builds on the one before it unless PARENT says otherwise; "-" means it
# stands alone and is shown whole, which the first line says: 03 and 04 (the first
# programs), 08 (the topology, read from sysfs: no WRITE), 09 (its program, built around
# lanes, would differ from 07's in every line), 16 (an all-to-all among ranks and its
# proxy share no line with 07's server and client), 17 (its kernels, in the protocol's
# order, then the Python that launches them: against 16 it showed 16's host all-to-all
# deleted line by line), 18 and 19 (prefill and decode, then
# trainers and inference ranks, on the transfer engine of common/transfer). 07 is shown
# against 06: its op queue takes the place of 06's wait for each WRITE, and 06's server
# loop shows taken away too, since 07's renews its endpoint.
# Where a chapter's code moved into common/, LESSON names that file: it is compared with
# the parent's program (shown whole where the chapter stands alone), then the chapter's
# own (short) file follows. NEW lists the common/ modules that hold a chapter's lesson,
# shown as new files after its own; the helpers around them are not (for 16 and 17: the
# launcher, the proxy's opening of NICs, the reference, the checks and the benchmark,
# all in common/, and the device helpers 17's kernels include from common/gpu/; for 19:
# all of common/weights/, model.py too, which describes the model and the two sides'
# layouts that the chapter's routing table is computed from, not the update). Where the
# lesson is a loop in C or the kernels of a GPU, the C or CUDA comes first.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A PARENT=([03]=- [04]=- [08]=- [09]=- [16]=- [17]=- [18]=- [19]=-)
declare -A LESSON=([09]=common/engine/multinet.py)
declare -A NEW=([07]=common/engine/opqueue.py [08]=common/engine/topo.py
                [10]=common/engine/warmup.py
                [11]="common/engine/lane.h common/engine/workers.py"
                [13]=common/engine/shards.py [16]=common/moe/proxy.c)
C_FIRST=" 11 12 13 14 15 17 "

die() { echo "diff: $*" >&2; exit 2; }
case "${1:-}" in
    -h|--help) echo "usage: bash scripts/diff.sh [--all] CHAPTER [OTHER]"
               sed -n '2,/^set -euo/{s/^# \{0,1\}//p}' "$0"; exit 0 ;;
esac
keep=""
[ "${1:-}" != --all ] || { keep=1; shift; }
[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: scripts/diff.sh [--all] CHAPTER [OTHER]"
for n in "$@"; do [[ $n =~ ^[0-9]{1,2}$ ]] || die "a chapter is a number such as 05, not '$n'"; done
chapter() { ls chapters/"$1"_*."$2" 2>/dev/null | head -n 1 || true; }
pair=""
if [ $# -eq 2 ]; then
    pair=1; from=$(printf %02d $((10#$1))); to=$(printf %02d $((10#$2)))
else
    to=$(printf %02d $((10#$1))); from=${PARENT[$to]:-$(printf %02d $((10#$to - 1)))}
fi
[ -n "$(chapter "$to" py)" ] || die "no chapter $to in chapters/"
[ "$from" = - ] || [ -n "$(chapter "$from" py)" ] || die "no chapter $from in chapters/"

if [ "$from" = - ]; then
    echo "# $to stands alone (it builds on no chapter's program): shown whole"
elif [ -n "$pair" ]; then
    echo "# $to against $from"
else
    echo "# $to against $from, the chapter it builds on"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Copy FILE to DIR/FILE, without its prose unless --all: Python's docstrings (module,
# class, function) and `# %% [markdown]` cells, and a C file's leading comment.
copy() {
    mkdir -p "$(dirname "$2/$1")"
    if [ -n "$keep" ]; then cp "$1" "$2/$1"; return; fi
    python3 - "$1" >"$2/$1" <<'EOF'
import ast, re, sys
path = sys.argv[1]
lines = open(path).read().splitlines(keepends=True)
drop = set()
if path.endswith(".py"):
    for node in ast.walk(ast.parse("".join(lines))):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            drop.update(range(body[0].lineno - 1, body[0].end_lineno))
    prose = False  # a "# %% [markdown]" cell is prose too: up to the next cell
    for i, line in enumerate(lines):
        if line.startswith("# %%"):
            prose = line.startswith("# %% [markdown]")
        if prose:
            drop.add(i)
else:  # leading block comments, except the /* cdef */ declarations cffi reads
    i = 0
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith("/*")):
        end = next((j for j in range(i, len(lines)) if "*/" in lines[j]), len(lines) - 1)
        if lines[i].startswith("/*") and not lines[i].startswith("/* cdef"):
            drop.update(range(i, end + 1))
        i = end + 1 if lines[i].startswith("/*") else i + 1
sys.stdout.write("".join(l for i, l in enumerate(lines) if i not in drop))
EOF
}
# Show OLD -> NEW (OLD "-": NEW is new), as paths of this repository.
show() {
    local old=/dev/null
    copy "$2" "$tmp/b"
    if [ "$1" != - ]; then copy "$1" "$tmp/a"; old="a/$1"; fi
    if cmp -s "$tmp/$old" "$tmp/b/$2"; then
        echo "# $2: the code of $1, unchanged (only its comments differ: --all shows them)"
        return
    fi
    (cd "$tmp" && git --no-pager diff --no-index --no-prefix --color=auto -- "$old" "b/$2") || true
}
# The parent's file of one kind (py, c, cu), or "-" where it has none.
parent() { local f=""; [ "$from" = - ] || f=$(chapter "$from" "$1"); echo "${f:--}"; }
python_part() {
    if [ -n "${LESSON[$to]:-}" ] && [ -z "$pair" ]; then
        show "$(parent py)" "${LESSON[$to]}"
        show - "$(chapter "$to" py)"
    else
        show "$(parent py)" "$(chapter "$to" py)"
    fi
    for f in ${NEW[$to]:-}; do [[ $f != *.py ]] || show - "$f"; done
}
c_part() {
    for ext in c cu; do
        [ -z "$(chapter "$to" "$ext")" ] || show "$(parent "$ext")" "$(chapter "$to" "$ext")"
    done
    for f in ${NEW[$to]:-}; do [[ $f == *.py ]] || show - "$f"; done
}
if [[ $C_FIRST == *" $to "* ]]; then c_part; python_part; else python_part; c_part; fi
