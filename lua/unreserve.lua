-- Gives back the spend of a paced request that will not be sent, while the
-- bucket's state is still the one its reservation wrote: KEYS[1] the
-- bucket; ARGV capacity, rate (tokens/s), cost, and the state the
-- reservation left, as stored ('-' and the instant in ns). A later spend
-- (a reservation stacked behind it, a check, a debit) moved the state: then
-- nothing is given back, since what would come back is the last slot
-- reserved, which another caller holds. Otherwise the state moves back by
-- the spend, never before now (the undo of a token bucket). Replies {1} when
-- it gave back, {0} otherwise. Mirrors Limit.Unreserve in pkg/bucket.
local now = now_us()
local key = KEYS[1]
local v = read_string(key)
if v ~= ARGV[4] then return {0} end
local rate = tonumber(ARGV[2])
local d, full = bucket_debt(key, tonumber(ARGV[1]), rate, now)
if d <= 0 then return {0} end
d = d - spend_ns(tonumber(ARGV[3]), rate)
if d <= 0 then
  redis.call('DEL', key)
else
  bucket_write(key, now, d, full)
end
return {1}
