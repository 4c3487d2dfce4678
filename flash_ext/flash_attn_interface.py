"""``flash_attn.flash_attn_interface`` under flash_ext: code that imports the functions from that module
(``from flash_attn.flash_attn_interface import flash_attn_func``) reads ``flash_ext.flash_attn_interface``.
``_get_block_size_n`` is there too, as flash_attn's tests import it to undo ``S_dmask``'s per-block scaling."""
from __future__ import annotations

from .dropout import _get_block_size_n
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from .kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
           "_get_block_size_n"]
