-- Applies one source region's spends for one client, at most once (see
-- debit_client.lua).
-- KEYS[1]: the client's marker for that source region and stream;
-- KEYS[2..]: the client's buckets.
-- ARGV[1]: the message's stream sequence; ARGV[2]: the marker's expiry (ms);
-- ARGV[3]: the stream's epoch (its creation, µs); then four per bucket: algorithm,
-- capacity, rate (tokens/s) or window (µs), amount.
-- Replies {1, overshoot of each bucket (strings)} when applied, {0} for a
-- duplicate.
return debit_client(KEYS[1], ARGV[1], ARGV[3], ARGV[2], now_us(), #KEYS - 1, KEYS, 2, ARGV, 4)
