"""The stage and tokenize stages' library: sources (local, S3, the Hub) staged and verified, record formats,
chat templates, records to token ids and labels, shards encoded once, the length analysis."""
