"""Model families (DESIGN §14): the registry that maps a checkpoint's config.json to its family.
A later step moves each family's code (model, loading, presets, reference) into fluxlab/models/<family>/."""
