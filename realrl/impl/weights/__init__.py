"""Moving weight versions from the trainer to the generation servers (docs/design.md §8)."""
