"""Text in and out: tokenizer, detokenizer, stop strings, the text processor, request
validation.

Never imports torch (tests/engine/test_layout.py checks)."""
