"""Tools run over a store: ``daskgen verify`` (the rules a finished row keeps, the chunks a finished partition
must hold, the images' checks), ``--repair``, ``daskgen pack``/``unpack``."""
