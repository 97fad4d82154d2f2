"""The paper's baseline allocators, for the simulator's comparisons only: Orca's
contiguous regions (`ContiguousKVCacheManager`, sized by a `ReservationPolicy`, placed
by a `BuddyAllocator`) and paged tables that never share (`UnsharedKVCacheManager`)."""
