"""The layout of the decode graphs' int64 metadata buffer (one host-to-device copy per step),
shared by the graphs (cuda_graphs.py) and the capturable guided loop (guided_loop.py) that reads
it, so neither imports the other for it.

Rows: LIVE is 1 for real rows, 0 for padding (padding rows never advance). NEXT[j]: the row
that becomes row j of the predicted next step (the last row of sequence j; the padding column
for j >= sequences). The first CARRIED rows are what the sampler carries over to the next step.
GUESS[:2]: (row, token) where the step runs a guess after that row (the token gate's check),
else (-1, 0). PREFIX[0] (the row's other columns 0): the step's common prefix, which the decode
attention reads once for all rows (attention.cascade_prefix; 0: none); it stays valid for the
predicted next step, whose rows are the same sequences one position on."""

IDS, POSITIONS, SLOTS, LIVE, LENS, PREFIX, SEEDS, HAS_MASK, NEXT, GUESS = range(10)
CARRIED = 4
