-- GCRA. State: one integer, the theoretical arrival time, which is the
-- token bucket's instant full again (see bucket_debt in instant.lua): the
-- two admit the same requests, and differ in what the store reports left
-- (whole requests of cost 1 for GCRA).
local gcra = instant_take
