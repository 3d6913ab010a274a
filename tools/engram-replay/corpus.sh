#!/usr/bin/env bash
# Assemble the replay corpus (issue 35 item 5) from text that ships in this
# machine's packages, one text file per source document, in five classes:
#   en    English prose: /usr/share/common-licenses, then the .txt/.md/.rst/README
#         files (plain or .gz) under /usr/share/doc
#   code  Python 3.11 standard library sources (pyenv's lib/python3.11/*.py and
#         the asyncio, email, http, json, logging, multiprocessing, unittest,
#         xml, importlib, concurrent, urllib, sqlite3, tomllib, zoneinfo packages)
#   de    German: every msgstr of /usr/share/locale/de/LC_MESSAGES/*.mo (one text a
#         catalog), then the German man pages /usr/share/man/de rendered by man(1)
#   fr    French: the same for fr
#   ja    Japanese: the same for ja
# Usage: tools/engram-replay/corpus.sh [OUT_DIR]  (default target/replay-corpus)
# OUT_DIR/<class>/ gets the texts, OUT_DIR/MANIFEST.txt the source of each text.
# The file lists are sorted so a rerun on the same machine gives the same corpus.
set -euo pipefail
OUT=${1:-target/replay-corpus}
PY=${PYTHON:-python3}
PYLIB=${PYLIB:-/root/.pyenv/versions/3.11.7/lib/python3.11}
rm -rf "$OUT"
mkdir -p "$OUT"/{en,code,de,fr,ja}
MAN="$OUT/MANIFEST.txt"
: > "$MAN"
n=0
emit() { # class source: copy stdin to the next numbered text of the class
    # (called with stdin redirected, never in a pipeline: the count must stay in this shell)
    local cls=$1 src=$2 dst
    n=$((n + 1))
    dst=$(printf '%s/%s/%05d.txt' "$OUT" "$cls" "$n")
    cat > "$dst"
    if [ -s "$dst" ]; then echo "$cls $(basename "$dst") $src" >> "$MAN"; else rm -f "$dst"; fi
}
cat_any() { case $1 in *.gz) zcat -- "$1" ;; *) cat -- "$1" ;; esac; }

# English prose.
for f in $(find /usr/share/common-licenses -type f | LC_ALL=C sort); do emit en "$f" < <(cat_any "$f"); done
while read -r f; do emit en "$f" < <(cat_any "$f"); done < <(find /usr/share/doc -type f \( -iname '*.txt' \
    -o -iname '*.txt.gz' -o -iname '*.md' -o -iname '*.md.gz' -o -iname '*.rst' -o -iname '*.rst.gz' \
    -o -iname 'README' -o -iname 'README.gz' \) | LC_ALL=C sort)

# Code.
code_files() {
    find "$PYLIB" -maxdepth 1 -name '*.py'
    for p in asyncio email http json logging multiprocessing unittest xml importlib concurrent urllib sqlite3 tomllib zoneinfo; do
        find "$PYLIB/$p" -name '*.py' -not -path '*/test*'
    done
}
while read -r f; do emit code "$f" < "$f"; done < <(code_files | LC_ALL=C sort)

# Non-English: gettext catalogs' translations, then rendered man pages.
MO_TEXTS=$(cat <<'PYEOF'
# The msgstr texts of a .mo file in its own charset (a minimal reader: the
# standard gettext module refuses catalogs whose header and texts disagree).
import re, struct, sys
b = open(sys.argv[1], "rb").read()
e = "<" if b[:4] == b"\xde\x12\x04\x95" else ">"
n, oo, to = struct.unpack(e + "3I", b[8:20])
def s(tab, i):
    ln, off = struct.unpack(e + "2I", b[tab + 8 * i: tab + 8 * i + 8])
    return b[off:off + ln]
hdr = s(to, 0) if n and not s(oo, 0) else b""
m = re.search(rb"charset=([-\w]+)", hdr)
cs = m.group(1).decode() if m else "utf-8"
for i in range(n):
    if s(oo, i):
        for part in s(to, i).split(b"\0"):
            sys.stdout.write(part.decode(cs, "replace") + "\n\n")
PYEOF
)
for lang in de fr ja; do
    for mo in $(find "/usr/share/locale/$lang/LC_MESSAGES" -name '*.mo' | LC_ALL=C sort); do
        emit "$lang" "$mo (msgstr)" < <("$PY" -c "$MO_TEXTS" "$mo")
    done
    for f in $(find "/usr/share/man/$lang" -type f | LC_ALL=C sort); do
        emit "$lang" "$f (man -l)" < <(MANWIDTH=80 timeout 30 man -l "$f" </dev/null 2>/dev/null | col -b)
    done
done
for c in en code de fr ja; do
    echo "$c: $(ls "$OUT/$c" | wc -l) texts, $(cat "$OUT/$c"/* | wc -c) bytes"
done
