"""`python -m pipeline ...` is the same as `kvbatch ...`."""
from pipeline.app import main

main()
