"""Quantised inference: the recipes and `QuantizedArray` (`recipes`), quantising a leaf at
real sizes (`leaf`), which leaves are matmul weights and `quantize` (`plan`), and running a
function on quantised params (`rules`)."""
