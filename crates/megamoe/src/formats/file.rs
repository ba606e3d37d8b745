//! File-level quantize / dequantize (the logic behind `megamoe quantize` and `megamoe dequantize`).
