"""The real-models matrix: plain LightningModules around models nobody here wrote (``models``), the
worker that trains a list of cells in one torchrun job (``worker``, ``ft_worker``), and the checks of their
results (``cells``, ``ft_replay``). Imported as ``matrix.<module>`` by the tests and the workers it starts."""
