"""The bottom layer: errors, randomness, the state and its codec, batches, lane arithmetic and the contracts operators and runners share."""
