"""Migration layers: other kernel libraries' public APIs, with their names, signatures and
defaults, running on tigon.

``tigon.compat.liger`` is Liger-Kernel 0.8.5's API (``liger_kernel.transformers``, its
``functional`` module and ``liger_kernel.chunked_loss``) mapped onto ``tigon.patch`` /
``tigon.patching``, ``tigon.functional``, ``tigon.nn`` and ``tigon.losses``: replacing
``liger_kernel`` by ``tigon.compat.liger`` in an import moves code to tigon's kernels. What tigon
lacks (an option, a value of one, or a whole name) raises an error that names it and says what to
do; ``tigon.compat.liger.NAME_MAP`` says, name by name, what each Liger name runs on or why it is
not provided (the docs' "Migrating from Liger-Kernel" page shows it).

A compat layer adds no kernels of its own: new code should use tigon's API directly.
"""
