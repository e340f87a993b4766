"""`python -m benchmarks.kvbatch_at_worst ROWS kvbatch-overrides...`: the kvbatch command with
`engine.max_batch: auto` holding up to ROWS rows past the backend's ceiling while every row fits at its worst
case (engine/batch_limits.py's BATCH_CEILING_AT_WORST) whatever the model's size, for probing that rule on a device
beyond the models it is the default for."""
import sys

from kvbatch.engine import batch_limits
from kvbatch.engine.backend import backend
from kvbatch.pipeline.cli import main

if __name__ == "__main__":
    batch_limits.BATCH_CEILING_AT_WORST[backend().name] = int(sys.argv.pop(1))
    batch_limits.AT_WORST_MAX_PARAMS = sys.maxsize
    main()
