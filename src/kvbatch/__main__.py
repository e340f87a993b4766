"""`python -m kvbatch ...` is the same as `kvbatch ...`."""
from kvbatch.pipeline.cli import main

main()
