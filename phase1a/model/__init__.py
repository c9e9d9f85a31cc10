"""The model: where its weights come from (loading.py), how training builds it and its optimizer (build.py),
adapters, packed attention, the chunked loss, and what a model costs in memory and FLOPs."""
