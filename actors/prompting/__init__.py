"""A turn's prompt in the tokenizer workers: chat templates, tokenizing, tool formats, output grammars."""
