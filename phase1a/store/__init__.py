"""What outlives a host: the store (an S3 prefix or a network mount), its S3 client, directories kept whole
with a manifest (bundles), the lease a training run holds, and the promoted versions as the stages read them
(promoted.py). Imports only core."""
