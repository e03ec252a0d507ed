"""Engine geometry, no bytes on the wire: the regions a manager registers and the page
geometry of each view (:mod:`.regions`), and the token and head axes of a heterogeneous pull
(:mod:`.geometry`). Imports nothing else of ``kvcopy.nixl``."""
