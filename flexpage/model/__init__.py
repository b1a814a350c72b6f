"""Model-side components: model runners, samplers."""
