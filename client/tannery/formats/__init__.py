"""Tensors in files, with no server: safetensors files, the ``.tannic`` checkpoint pair, files
kept with an archive (a model folder's config and tokenizer), and replacing a file whole."""
