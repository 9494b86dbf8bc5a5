"""synthesize: a user's documents -> checked question/answer pairs (stage synthesize@NAME).

`documents` reads .md, .txt and .pdf; `chunks` cuts them along headings and paragraphs with a
GPT-2 token limit; `generate` asks an OpenAI-compatible endpoint for pairs per chunk (cached,
bounded concurrency); `filters` drops the pairs a fine-tuning set should not keep; `stage` is
the recipe that writes data/synthetic/NAME/ and the report. docs/synthesize.md.
"""
