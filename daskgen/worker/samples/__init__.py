"""On the worker, a partition's rows into samples and into its region: the rows' inputs, each sample's params and
seed, the samples an interrupted attempt stored, the engine's results kept as they came, and the padded region."""
