"""`python -m kvbatch ...` is the same as `kvbatch ...`."""
from kvbatch.pipeline.app import main

main()
