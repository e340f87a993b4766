"""Input shapes other than kvbatch's own columns, mapped to them: OpenAI Batch API files, ShareGPT, Alpaca."""
