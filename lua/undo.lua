-- Undoes the spends of an all-or-nothing check on one client's buckets when
-- a rule of another client (another slot) refused the same request.
-- KEYS the buckets; ARGV[1] the instant (µs) at which the multi script spent
-- (the last value of its reply), then four per bucket: algorithm, capacity,
-- rate or window (µs), amount. Each gives back at most what that spend took
-- (see undo_lib.lua).
local now = now_us()
local at = tonumber(ARGV[1])

for i = 1, #KEYS do
  local j = 1 + (i - 1) * 4
  local undo = undos[ARGV[j + 1]]
  if undo then
    undo(KEYS[i], tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4]), now, at)
  end
end
return 1
