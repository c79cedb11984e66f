"""Quantised inference: the recipes and `QuantizedArray` (`recipes`), quantising a leaf at
real sizes (`leaf`), which leaves are matmul weights and `quantize` (`plan`), running a
function on quantised params (`rules`), training with the numerics it serves
(quantization-aware training, `qat`), static activation scales from calibration batches
(`calibrate`), and the int8/FP8 key/value cache of a decode loop (`kv_cache`)."""
