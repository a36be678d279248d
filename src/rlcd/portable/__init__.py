"""The portable export (`rlcd export RUN --format onnx`): the merged backbone as ONNX, the scorer and the
temperatures as tensors, the tokenizer as tokenizer.json, served by onnxruntime + tokenizers + numpy.

* `layout`   torch-free: requests' rows -> the graph's inputs (shared prefix packed with its suffixes)
* `runtime`  torch-free: `PortableModel` (what `Predictor` drives), `load_portable` -> Predictor
* `exporter` torch: the graph (`torch.onnx.export`), int8, the files, the parity gate around them
* `parity`   numpy: decision flips, max |dp|, NLL and ECE deltas between two scorings of one split

Nothing is imported here, so `rlcd.portable.runtime` stays torch-free.
"""
