"""Model weights from elsewhere: GGUF files (llama.cpp, Ollama) imported as Hugging Face directories.

    gguf_file.py          read and check a GGUF file (the `gguf` package's reader)
    dequant.py            F32/F16/BF16, Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K -> float32 (numpy)
    gguf_config.py        config.json from the GGUF metadata (Llama, Qwen2)
    gguf_tokenizer.py     tokenizer.json and tokenizer_config.json from the GGUF vocabulary
    safetensors_writer.py model.safetensors written one tensor at a time
    gguf_import.py        the import: a temporary directory renamed into place, with a manifest
    sources.py            a model entry's GGUF `source` -> its imported directory (first use, reuse)
    cli.py                `weir models import-gguf FILE --name NAME`

On the shared floor: the worker's engine factory, `weir up` and the CLI use it; it imports
schemas/ and nothing from services/.
"""

from weir.models.gguf_file import GGUFError

__all__ = ["GGUFError"]
