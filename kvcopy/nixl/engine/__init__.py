"""Engine geometry, no bytes on the wire: the regions a manager registers and the page
geometry of each view (:mod:`.regions`), the token and head axes of a heterogeneous pull
(:mod:`.geometry`), and an engine rank's record with the check that a peer can serve it
(:mod:`.info`). Imports nothing else of ``kvcopy.nixl``."""
