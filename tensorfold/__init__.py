"""TensorFold: an OpenAI-compatible LLM server whose every reply is a pure function of
(checkpoint, template, prompt, seed, sampling settings).

Importing the package touches no GPU and loads no model.
"""
__version__ = "0.1.0"
