"""The layout of the decode graphs' int64 metadata buffer (one host-to-device copy per step),
shared by the graphs (cuda_graphs.py) and the capturable guided loop (guided_loop.py) that reads
it, so neither imports the other for it.

Rows: LIVE is 1 for real rows, 0 for padding (padding rows never advance). NEXT[j]: the row
that becomes row j of the predicted next step (the last row of sequence j; the padding column
for j >= sequences). The first CARRIED rows are what the sampler carries over to the next step.
GUESS[:2]: (row, token) where the step runs a guess after that row (the token gate's check),
else (-1, 0)."""

IDS, POSITIONS, SLOTS, LIVE, LENS, SEEDS, HAS_MASK, NEXT, GUESS = range(9)
CARRIED = 4
