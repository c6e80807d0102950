"""MLA decode kernels in TileLang. The op lives in ``mla.decode``; see README.md."""

__version__ = "0.1.0"
