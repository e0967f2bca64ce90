# Sourced by the device scripts (multi_gpu.sh, one_gpu.sh) with their arguments, after they set
# BUDGET_S and PIECE_PATTERN: sets DRY (1 with --dry-run), OUT (default /tmp/<script>_out) and an
# empty $SUMMARY; `left` says how many of BUDGET_S seconds are left, `piece` runs one measurement
# under its own timeout and notes its status and the lines of its log that match PIECE_PATTERN
# in $SUMMARY, so a hang loses only that piece; `keep` copies the results files it wrote to $OUT.

DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT=${OUT:-/tmp/$(basename "$0" .sh)_out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
STARTED=$(mktemp)  # results files newer than this one were written by this run

left() { echo $(( BUDGET_S - SECONDS > 10 ? BUDGET_S - SECONDS : 10 )); }

# keep GLOB: copy the results files this run wrote that match GLOB to $OUT (the summary cannot be
# the reference: every piece appends to it).
keep() { find benchmarks/results -name "$1" -newer "$STARTED" -exec cp {} "$OUT/" \; ; }

# piece NAME LIMIT_S LOG CMD...: run CMD under `timeout`, note its status and tail in the summary.
piece() {
  local name=$1 limit=$2 log=$3 start=$SECONDS rc from
  shift 3
  (( limit > $(left) )) && limit=$(left)
  echo "== $name (limit ${limit}s) $*" >> "$log"
  from=$(wc -l < "$log")
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  {
    echo "== $name: rc=$rc$([[ $rc == 124 || $rc == 137 ]] && echo ' TIMED OUT') in $((SECONDS - start))s"
    tail -n +"$((from + 1))" "$log" \
      | grep -E "$PIECE_PATTERN" | tail -n 14
  } >> "$SUMMARY"
}
