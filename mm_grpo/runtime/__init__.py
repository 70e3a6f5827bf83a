"""FLUX at run time, above the model and the parallel groups: this rank's model chunks, their
weights, the config a model.json names, and their forward / backward under megatron-core's schedules."""
