"""The base of the errors lookupdec raises for a reason it can state (a model that cannot be loaded, a cache file
that cannot be used, a run or a server that cannot start): ``except lookupdec.LookupdecError`` catches them all,
and their message is one line meant for the user. Mistakes in arguments stay ``ValueError`` / ``TypeError``, as
in the libraries lookupdec is called beside; a :class:`CacheFileError` is both."""


class LookupdecError(Exception):
    """Something lookupdec cannot do, said in one line."""
