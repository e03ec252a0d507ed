"""Which of P's pages land in which of D's pages: pull plans (:mod:`.plan`), the peers and
regions serving each layer (:mod:`.routes`), NIXL descriptor rows (:mod:`.descriptors`),
arena pack orders (:mod:`.pack_order`). Imports engine geometry, never a wire format."""
