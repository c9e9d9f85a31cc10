"""What every stage stands on: units, atomic writes, locks, logs, errors, fingerprints, the progress meter,
retries, the hardware catalogue. Imports nothing else of the library."""
