"""The fused modules and linears every patched forward calls (the fused/int8 linears, the attention function
transformers dispatches to and its backend choice), over ``fuseinfer.ops``; no model family's names."""
