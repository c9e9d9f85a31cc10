"""What outlives a host: the store (an S3 prefix or a network mount), its S3 client, directories kept whole
with a manifest (bundles), and the lease a training run holds. Imports only core."""
