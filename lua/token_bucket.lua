-- Token bucket. State: one integer, the instant the bucket is full again
-- (see bucket_debt in instant.lua); tokens(now) = capacity - (full - now) *
-- rate, the lazy refill min(C, tokens + elapsed * rate) without a second
-- field. The key expires when the bucket would be full, so idle clients
-- cost no memory.
local token_bucket = instant_take
