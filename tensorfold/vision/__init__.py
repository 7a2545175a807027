"""Image input for vision-language checkpoints (Qwen3.5 dense with --vision).

Plain Python above the backend seam: image.py decodes and measures an image and turns it into
the tower's flattened patches (Pillow and numpy, no torch); placement.py lays images into a
prompt (pad tokens, multimodal rope positions, prefix-cache keys). The tower itself is a model
part (models/vision_tower.py) and the encoded images live in the runner's cache
(backends/image_cache.py), keyed by each image's content hash.
"""
