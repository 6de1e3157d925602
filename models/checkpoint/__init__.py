"""speedc.models.checkpoint: checkpoint directories. files.py is the layout and what can be read
without loading weights (standard library only), tensor_source.py where a tensor's bytes are
(numpy only), torch_io.py reading and writing checkpoints with torch (safetensors).

Importing the package imports none of them, so the torch-free parts stay torch-free."""
