"""Tensors in files, with no server: safetensors files (``tannery.save_safetensors``), the
``.tannic`` checkpoint pair (``tannery.torch.write``), and replacing a file whole."""
