-- quota_reset.lua: quota.reset. A: quota keys. Every bucket's use is forgotten (its "u" field
-- deleted); reservations ("r") stay and settle as usual. Reply: the use forgotten.
local function quota_reset_main(A)
  local cleared = 0
  for i = 1, #A do
    local rk = T .. ':quota:' .. A[i]
    local flat = rcall('HGETALL', rk)
    local fields = {}
    for j = 1, #flat, 2 do
      if sbyte(flat[j], -1) == 117 then -- 'u'
        fields[#fields + 1] = flat[j]
        cleared = cleared + flat[j + 1]
      end
    end
    if #fields > 0 then
      rcall('HDEL', rk, unpack(fields))
    end
  end
  return cleared
end
